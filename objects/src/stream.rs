//! A byte stream from async code to a blocking reader (an import that
//! reads `std::io::Read`) that can end in failure: the reader gets an error,
//! never a clean end-of-file, unless the sender says the stream is whole.
//! A plain pipe cannot tell a finished stream from one whose writer gave
//! up, and a tar reader takes an end at an entry boundary for the archive's.

use std::io::{self, Read};

use bytes::{Buf, Bytes};
use tokio::sync::mpsc::{Receiver, Sender, channel};

enum Piece {
    Data(Bytes),
    End,
}

pub struct StreamSender(Sender<Piece>);
pub struct StreamReader {
    pieces: Receiver<Piece>,
    current: Bytes,
    ended: bool,
}

/// A stream holding at most `depth` pieces in flight. The reader must not
/// run on an async runtime's thread (it blocks).
pub fn stream(depth: usize) -> (StreamSender, StreamReader) {
    let (tx, rx) = channel(depth);
    (StreamSender(tx), StreamReader { pieces: rx, current: Bytes::new(), ended: false })
}

impl StreamSender {
    /// Waits while the reader is `depth` pieces behind; `Err` when the
    /// reader is gone.
    pub async fn send(&self, bytes: Bytes) -> io::Result<()> {
        let gone = |_| io::Error::new(io::ErrorKind::BrokenPipe, "the reader stopped");
        self.0.send(Piece::Data(bytes)).await.map_err(gone)
    }

    /// The stream is whole. Dropping the sender without this is a failure.
    pub async fn finish(self) {
        let _ = self.0.send(Piece::End).await;
    }
}

impl Read for StreamReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            if self.ended {
                return Ok(0);
            }
            match self.pieces.blocking_recv() {
                Some(Piece::Data(bytes)) => self.current = bytes,
                Some(Piece::End) => self.ended = true,
                None => {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the stream was cut short"));
                }
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        self.current.advance(n);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().build().unwrap()
    }

    #[test]
    fn a_finished_stream_reads_whole_and_ends() {
        let (tx, mut rx) = stream(2);
        let writer = std::thread::spawn(move || {
            runtime().block_on(async {
                for piece in ["ab", "", "cde"] {
                    tx.send(Bytes::from(piece)).await.unwrap();
                }
                tx.finish().await;
            })
        });
        let mut out = String::new();
        rx.read_to_string(&mut out).unwrap();
        writer.join().unwrap();
        assert_eq!(out, "abcde");
    }

    #[test]
    fn a_stream_dropped_unfinished_is_an_error_not_an_end() {
        let (tx, mut rx) = stream(2);
        runtime().block_on(tx.send(Bytes::from("ab"))).unwrap();
        drop(tx);
        let mut out = Vec::new();
        let err = rx.read_to_end(&mut out).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(out, b"ab");
    }
}
