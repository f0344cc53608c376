//! One exchange over a fresh TCP connection, and reading the answer back
//! (bounded in time; chunked bodies undone).

use super::*;

#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    /// The head, lowercase.
    pub(crate) head: String,
    pub(crate) body: Vec<u8>,
}

pub(crate) enum Outcome {
    Answered(Answer),
    /// The connection ended without a readable answer.
    Silent(String),
    TimedOut,
}

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

pub(crate) fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().skip(1).find_map(|l| {
        let (n, v) = l.split_once(':')?;
        (n.trim() == name).then(|| v.trim())
    })
}

pub(crate) fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let end = find(b, b"\r\n").ok_or("a chunk size line is incomplete")?;
        let size_text = String::from_utf8_lossy(&b[..end]).into_owned();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or_default().trim(), 16)
            .map_err(|_| format!("bad chunk size {size_text:?}"))?;
        b = &b[end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            return Err("a chunk is incomplete".into());
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// The final answer in `buf` (interim 1xx answers skipped), and whether it
/// is complete by its own framing (else only the end of the connection ends it).
pub(crate) fn parse_answer(buf: &[u8], head_only: bool) -> Result<(Answer, bool), String> {
    let mut rest = buf;
    loop {
        let end = find(rest, b"\r\n\r\n").ok_or_else(|| format!("no complete head in {:?}", excerpt(rest)))?;
        let head = String::from_utf8_lossy(&rest[..end]).to_ascii_lowercase();
        let status = head
            .strip_prefix("http/1.1 ")
            .or_else(|| head.strip_prefix("http/1.0 "))
            .and_then(|s| s.get(..3))
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| format!("no status line in {head:?}"))?;
        let body = &rest[end + 4..];
        if (100..200).contains(&status) && status != 101 {
            rest = body;
            continue;
        }
        if head_only || status == 204 || status == 304 {
            return Ok((Answer { status, head, body: Vec::new() }, true));
        }
        if header(&head, "transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            return match dechunk(body) {
                Ok(b) => Ok((Answer { status, head, body: b }, true)),
                Err(_) => Ok((Answer { status, head, body: body.to_vec() }, false)),
            };
        }
        if let Some(n) = header(&head, "content-length") {
            let n: usize = n.parse().map_err(|_| format!("content-length {n:?} in the answer"))?;
            let complete = body.len() >= n;
            return Ok((Answer { status, head, body: body[..n.min(body.len())].to_vec() }, complete));
        }
        return Ok((Answer { status, head, body: body.to_vec() }, false));
    }
}

pub(crate) async fn exchange(addr: SocketAddr, wire: &Wire, head_only: bool, limit: Duration) -> Outcome {
    let Ok(Ok(mut tcp)) = tokio::time::timeout(limit, TcpStream::connect(addr)).await else {
        return Outcome::Silent("could not connect".into());
    };
    let (mut rd, mut wr) = tcp.split();
    // Written while the answer is read: the server may answer (and close)
    // before it has read everything, as it should for a body too large.
    let write = async {
        let (now, later) = wire.bytes.split_at(wire.trickle.map_or(wire.bytes.len(), |(at_once, _)| at_once.min(wire.bytes.len())));
        let mut written = wr.write_all(now).await.is_ok();
        if let Some((_, pause)) = wire.trickle {
            for byte in later {
                if !written {
                    break;
                }
                tokio::time::sleep(pause).await;
                written = wr.write_all(std::slice::from_ref(byte)).await.is_ok();
            }
        }
        if written && wire.hang_up {
            let _ = wr.shutdown().await;
        }
        // Not dropped until the answer is in: a dropped write half would
        // half-close the connection, and change what the server sees.
        std::future::pending::<()>().await
    };
    let read = async {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            match rd.read(&mut chunk).await {
                Ok(0) => break,
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    if matches!(parse_answer(&buf, head_only), Ok((_, true))) {
                        break;
                    }
                }
                Err(e) if buf.is_empty() => return Err(format!("the connection failed before any answer: {e}")),
                Err(_) => break,
            }
        }
        if buf.is_empty() {
            return Err("the connection closed without an answer".to_owned());
        }
        parse_answer(&buf, head_only).map(|(a, _)| a)
    };
    let run = async {
        tokio::select! {
            answer = read => answer,
            () = write => unreachable!("the writer never finishes"),
        }
    };
    match tokio::time::timeout(limit, run).await {
        Ok(Ok(a)) => Outcome::Answered(a),
        Ok(Err(why)) => Outcome::Silent(why),
        Err(_) => Outcome::TimedOut,
    }
}

pub(crate) async fn ready(addr: SocketAddr) -> bool {
    let wire = Wire {
        bytes: b"GET /readyz HTTP/1.1\r\nhost: relay\r\nconnection: close\r\n\r\n".to_vec(),
        hang_up: false,
        may_hang: false,
        trickle: None,
    };
    matches!(exchange(addr, &wire, false, Duration::from_secs(5)).await, Outcome::Answered(a) if a.status == 200)
}

// ---------------------------------------------------------------------------
// Judging an answer.

pub(crate) fn excerpt(bytes: &[u8]) -> String {
    let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(EXCERPT_BYTES)]).escape_debug().to_string();
    if bytes.len() > EXCERPT_BYTES { format!("{shown}… ({} bytes)", bytes.len()) } else { shown }
}
