"""The streaming primitives both jobs run on. Nothing here imports the loader, refit or torch."""
