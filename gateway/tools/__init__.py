"""Tool calling: parsers of each model family's tool-call format, and tool_choice constraints."""
