"""Request preparation, the same for every transport: a request's body parsed, its prompt tokenized, its block keys."""
