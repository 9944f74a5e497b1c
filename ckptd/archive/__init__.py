"""Archiving checkpoints to an object store before retention deletes them: copied, verified, and
only then may the local copy go.

- `store`: the seam (`Store`, what ckptd asks of any object store) and its errors;
- `s3`: the S3 API through boto3 (AWS, MinIO, Ceph RGW), credentials from the standard chain only;
- `manifest`: a checkpoint's files as read (each entry's identity) and the manifest object that
  says an archive is whole, written last and create-only;
- `upload`: `Archiver`, which copies one checkpoint, verifies every object against what it read,
  resumes what an interrupted attempt left and aborts its orphaned multipart uploads;
- `gate`: why a checkpoint may not be deleted yet (`archive_problem`), asked by the reaper's
  re-check just before the rename and by `plan`.

Nothing here deletes a remote object: an archive, once whole, is never replaced or removed by ckptd.
"""
