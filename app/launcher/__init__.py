"""Starting the system: `bert serve` (uvicorn), `bert up` (everything on one machine), the first-start bootstrap and its demo assets."""
