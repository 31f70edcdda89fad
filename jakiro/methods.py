"""Decoding method names, in one place for the API, the command line, the benchmark and the server."""

# +pld: the draft's tree with prompt-lookup branches added (merged where the tokens coincide)
# draft-model: a small model of the target's family drafts (``--draft-model``)
# eagle3: a draft in the EAGLE-3 layout other engines load (``jakiro export``)
METHODS = ("ar", "pld", "eagle2", "jakiro", "eagle3", "eagle2+pld", "jakiro+pld", "eagle3+pld", "draft-model",
           "draft-model+pld")
