"""DeepSeek sparse attention (DSA): the lightning indexer's step in a patched MLA module."""
