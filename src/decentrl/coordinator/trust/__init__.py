"""Who may call and whom to believe: credentials, the request gate, reputation, verification holds."""
