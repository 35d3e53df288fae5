"""Small, version-guarded adaptations to vLLM internals; each module names the upstream code it
relates to.

See the top-level `patches/README.md` for the list."""
