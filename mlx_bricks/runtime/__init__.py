"""The dispatch seam: op kinds (what a brick computes, its stock path, its variants), the
dispatch that decides brick or stock per piece and call, and the first-call guard."""
