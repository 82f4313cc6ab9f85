"""The coordinator's HTTP surface: the app and its routes, body reading and parsing, the error type."""
