"""Anthropic's surface: /v1/messages, with its wire types."""
