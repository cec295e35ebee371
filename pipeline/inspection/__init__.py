"""Looking into a run: why a call's request is what it is (`why`), the threads of a run and the
history they share (`threads`), and queries over the ledger (`ledger_query`)."""
