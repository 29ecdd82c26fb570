"""The dispatch pipeline: shapes -> sweep -> corpus -> train -> certify -> generate -> install -> runtime."""

__version__ = "0.1.0"
