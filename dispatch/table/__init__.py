"""Stage 3, table: certification, code generation and checks of a table."""
