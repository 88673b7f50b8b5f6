"""OpenAI's surface: /v1/chat/completions, /v1/completions, /v1/responses, with their wire types."""
