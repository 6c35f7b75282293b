"""The @function DSL: prompt programs that call the runtime through a backend."""
