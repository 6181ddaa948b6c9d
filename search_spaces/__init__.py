"""Built-in search spaces (YAML), installed as the package `headsearch.search_spaces`."""
