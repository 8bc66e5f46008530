"""The HTTP edge: middleware, dependencies and one router per resource (routes/)."""
