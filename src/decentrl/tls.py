"""One verifying TLS context per process and CA setting.

httpx's default verifying context loads its CA bundle (or SSL_CERT_FILE/SSL_CERT_DIR) afresh for
each client, about 20 ms each; a role holds several clients, all on its start-up path."""

from __future__ import annotations

import functools
import os
import ssl

import httpx


def verifying_context() -> ssl.SSLContext:
    """httpx's default verifying context for the CA setting as it is now, made once."""
    return _context_for(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.cache
def _context_for(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    return httpx.create_ssl_context()  # reads the same two variables
