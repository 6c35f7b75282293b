"""Model implementations over the paged KV layout."""
