"""KV memory pools and the radix-tree prefix cache."""
