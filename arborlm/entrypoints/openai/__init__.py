"""The OpenAI-compatible API: request models, chat rendering, tool calls, and the
chat-completions and completions handlers."""
