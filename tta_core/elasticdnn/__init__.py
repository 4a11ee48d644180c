"""ElasticDNN: a gated master network (gates), dense surrogates cut from it for
one domain (surrogate), filter-grained updates written back into the master
(filter_update), the offline master training (train) and the multi-app fleet (fleet)."""
