"""The local cluster: a coordinator process that hosts the store, and its workers."""
