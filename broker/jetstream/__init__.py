"""Generic JetStream reading: the pull loop, its fast path, one-shot reads"""
