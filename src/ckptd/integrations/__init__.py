"""Commit records from the frameworks' own save hooks (`ckptd.attest`), one line in a training
script each. Every module imports its framework only when used, so importing ckptd needs none."""
