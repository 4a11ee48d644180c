"""Process runtime: environment doctor and allocator tuning."""
