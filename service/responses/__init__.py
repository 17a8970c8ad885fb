"""OpenAI's Responses API on the chat machinery: its wire types, its input items
as chat messages, its serving logic and its stream of events."""
