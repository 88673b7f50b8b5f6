"""Ollama's surface: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version."""
