"""What only the operator tools use (`exo replay`, `exo inspect`, `exo events`): the event log
read raw and fast, undecoded snapshots, and the cluster's streams and buckets as they stand. The
node itself never imports this package."""
