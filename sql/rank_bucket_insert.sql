-- Ranking summary of one checkpoint's blocks, by score (mergepipe_db/ranking.py): its scored candidates
-- (delta_l2 non-zero) in log-scale buckets of delta_l2, with their count, bytes and smallest delta_l2. Any
-- partition would do (the planner only needs each bucket's bytes and exact minimum); NaN and huge values
-- (NaN compares above every number) and tiny or negative ones (LN is undefined there) get buckets of their own.
INSERT INTO mp_rank_bucket (checkpoint_id, bucket, blocks, nbytes, min_l2)
SELECT checkpoint_id, bucket, COUNT(*), SUM(nbytes), MIN(delta_l2)
FROM (
    SELECT checkpoint_id, nbytes, delta_l2,
           CASE WHEN delta_l2 > 1e300 THEN 1000000
                WHEN delta_l2 < 1e-300 THEN -1000000
                ELSE CAST(FLOOR(LN(delta_l2) * 256) AS INTEGER) END AS bucket
    FROM mp_block
    WHERE checkpoint_id = :checkpoint_id AND delta_l2 <> 0
) s
GROUP BY checkpoint_id, bucket
