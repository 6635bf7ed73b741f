//! Incremental detokenization: a token can end in the middle of a UTF-8 character (byte-level
//! BPE and `<0xNN>` byte tokens split characters freely), so text is released only once complete.

use crate::Tokenizer;

/// Feeds ids one by one and returns the text that is complete so far. Concatenating every
/// `push` result and `finish` gives exactly `tokenizer.decode(all_ids)`.
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    /// Bytes of a character that is not complete yet (at most 3).
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            pending: Vec::new(),
        }
    }

    /// Adds one token and returns the newly completed text (possibly empty). Byte sequences that
    /// can never become valid UTF-8 come out as U+FFFD, like [`Tokenizer::decode`].
    pub fn push(&mut self, id: u32) -> String {
        self.pending
            .extend_from_slice(self.tokenizer.token_bytes(id));
        let mut text = String::new();
        let mut consumed = 0;
        loop {
            match std::str::from_utf8(&self.pending[consumed..]) {
                Ok(valid) => {
                    text.push_str(valid);
                    consumed = self.pending.len();
                    break;
                }
                Err(error) => {
                    let valid_end = consumed + error.valid_up_to();
                    text.push_str(&String::from_utf8_lossy(&self.pending[consumed..valid_end]));
                    match error.error_len() {
                        Some(invalid) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            consumed = valid_end + invalid;
                        }
                        // An incomplete character at the end: keep it for the next token.
                        None => {
                            consumed = valid_end;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        text
    }

    /// Ends the stream; a character left incomplete comes out as U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}
