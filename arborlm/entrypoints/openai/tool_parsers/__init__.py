"""Tool-call formats, one module each, behind the `ToolCallFormat` / `ToolCallParser` contract (`base.py`)."""
