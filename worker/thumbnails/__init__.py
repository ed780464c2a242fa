"""The built-in thumbnail task: its renderers (render/) and its operations."""
