"""exo's own routes: instances and desires, models and cards, downloads, state, events, metrics, cancel."""
