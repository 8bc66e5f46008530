"""API keys as data: the keys file and its secrets' hashes (keyfile.py), the service's view of it,
re-read on change, with the built-in BERT_API_KEY and BERT_ADMIN_KEY (keyring.py), each key's request
and token rates (limits.py) and the audit log of who changed what (audit.py)."""
