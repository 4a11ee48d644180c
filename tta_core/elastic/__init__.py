"""ElasticDNN (issue #22): gated master, surrogates, filter-grained updates, fleet planning."""
