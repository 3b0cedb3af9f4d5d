"""mixfleet.costmodel.records.

Run records: the run log both worlds write (`runlog`: records and schemas; its writer `runlog_writer` and
reader `runlog_reader`), the one update / group ledger (`ledger`), a run log's summary with steady-state
analysis (`runsummary`), its metrics for TensorBoard / W&B (`trackers`) and the one output-folder rule
(`outdir`).
"""
