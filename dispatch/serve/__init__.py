"""Stage 4, serve: installed tables and the runtime (no scikit-learn, jinja2 or certifier)."""
