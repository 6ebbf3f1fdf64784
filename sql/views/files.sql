CREATE VIEW files AS
SELECT c.name AS checkpoint, f.file_idx, f.relpath, f.path, f.size, f.mtime_ns, f.sha256, f.header_len
FROM mp_file f
JOIN mp_checkpoint c ON c.id = f.checkpoint_id
