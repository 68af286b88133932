"""The Gated DeltaNet brick (issue 36): the chunked gated delta rule."""
