"""The engine: a request begun, stepped (propose -> one target forward -> verify -> commit) and
finished, alone or in batches, and what it keeps between steps."""
