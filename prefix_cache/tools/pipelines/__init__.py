"""The engines and stages the commands start: vLLM engines with the cache (`engines`), stepped
by threads of their own (`engine_loop`), chained into pipelines (`pipeline`, `stream_pipeline`,
`codec_stage`), read by consumers (`streaming`, `soak_consumer`), their logs kept aside."""
