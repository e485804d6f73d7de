"""The transformers fallback: any decoder-only architecture transformers implements, run by
transformers' own modeling code with tessera's paged attention plugged in."""
