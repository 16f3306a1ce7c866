"""A real S3 server (SeaweedFS on 127.0.0.1, through scripts/s3-server) for the Python harnesses,
and a bucket made on it with a SigV4-signed PUT from the standard library (no SDK, no curl);
`python3 tests/lib/s3.py make-bucket DIR BUCKET` does the latter for the shell scripts."""
import datetime, hashlib, hmac, os, shutil, subprocess, tempfile, urllib.parse, urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "s3-server")


class S3Server:
    """Started at construction, stopped by `stop` (TERM, then KILL: scripts/s3-server's bounds).
    `env`: the KEY=value lines `start` printed (S3_ENDPOINT, S3_REGION, AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, ...)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="coalescefs-s3-server-")
        r = subprocess.run([SCRIPT, "start", self.dir], capture_output=True, text=True)
        if r.returncode != 0:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise RuntimeError(f"scripts/s3-server start: {r.stderr.strip()}")
        self.env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    def credentials(self):
        return {k: self.env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}

    def make_bucket(self, bucket):
        make_bucket(self.env, bucket)

    def stop(self):
        subprocess.run([SCRIPT, "stop", self.dir], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def make_bucket(env, bucket):
    """PUT /bucket, signed (AWS Signature Version 4); an existing bucket of ours is fine."""
    endpoint, region = env["S3_ENDPOINT"], env["S3_REGION"]
    access, secret = env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    host = urllib.parse.urlparse(endpoint).netloc
    amz_date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    day, payload = amz_date[:8], hashlib.sha256(b"").hexdigest()
    signed = "host;x-amz-content-sha256;x-amz-date"
    canonical = "\n".join(["PUT", f"/{bucket}", "", f"host:{host}", f"x-amz-content-sha256:{payload}",
                           f"x-amz-date:{amz_date}", "", signed, payload])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    request = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT", headers={
        "x-amz-content-sha256": payload, "x-amz-date": amz_date,
        "Authorization": f"AWS4-HMAC-SHA256 Credential={access}/{scope}, SignedHeaders={signed}, "
                         f"Signature={signature}"})
    try:
        urllib.request.urlopen(request, timeout=30).read()
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        if "BucketAlreadyOwnedByYou" not in body:
            raise RuntimeError(f"S3 PUT /{bucket}: HTTP {e.code}: {body[:300]}") from e


if __name__ == "__main__":
    # `tests/lib/s3.py make-bucket DIR BUCKET`: the bucket on the server `scripts/s3-server start
    # DIR` started (its KEY=value lines in DIR/env), for the shell scripts.
    import sys
    if len(sys.argv) != 4 or sys.argv[1] != "make-bucket":
        sys.exit("usage: tests/lib/s3.py make-bucket DIR BUCKET")
    with open(os.path.join(sys.argv[2], "env")) as f:
        server_env = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
    make_bucket(server_env, sys.argv[3])
