"""Request and response bodies of the API surfaces, one module per surface family."""
