"""Decoding method names, in one place for the API, the command line, the benchmark and the server."""

# +pld: the draft's tree with prompt-lookup branches added (merged where the tokens coincide)
# draft-model: a small model of the target's family drafts (``--draft-model``)
METHODS = ("ar", "pld", "eagle2", "jakiro", "eagle2+pld", "jakiro+pld", "draft-model", "draft-model+pld")
