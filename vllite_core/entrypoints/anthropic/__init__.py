"""Anthropic's Messages API (/v1/messages), served on the chat path."""
