"""What the HTTP API and the CLI share: jobs of any task, validation, signed credentials."""
