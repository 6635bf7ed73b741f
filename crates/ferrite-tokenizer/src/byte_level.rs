//! GPT-2's reversible byte <-> printable-character alphabet used by byte-level BPE vocabularies.
//!
//! Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, DEL, NBSP,
//! soft hyphen) are shifted to U+0100.. in byte order, so every token is printable text.

/// Highest code point the alphabet uses (256 + 68 shifted bytes - 1).
const ALPHABET_END: usize = 256 + 68;

fn stands_for_itself(byte: u8) -> bool {
    matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The byte-level alphabet: byte -> char, and its inverse.
pub(crate) struct ByteAlphabet {
    byte_to_char: [char; 256],
    char_to_byte: [Option<u8>; ALPHABET_END],
}

impl ByteAlphabet {
    pub(crate) fn new() -> Self {
        let mut byte_to_char = ['\0'; 256];
        let mut char_to_byte = [None; ALPHABET_END];
        let mut shifted = 0u32;
        for byte in 0..=255u8 {
            let code = if stands_for_itself(byte) {
                u32::from(byte)
            } else {
                shifted += 1;
                255 + shifted
            };
            // Every code is below ALPHABET_END, so neither conversion can fail.
            let ch = char::from_u32(code).unwrap_or('\0');
            byte_to_char[usize::from(byte)] = ch;
            char_to_byte[code as usize] = Some(byte);
        }
        Self {
            byte_to_char,
            char_to_byte,
        }
    }

    pub(crate) fn char_of(&self, byte: u8) -> char {
        self.byte_to_char[usize::from(byte)]
    }

    pub(crate) fn byte_of(&self, ch: char) -> Option<u8> {
        self.char_to_byte.get(ch as usize).copied().flatten()
    }

    /// Spells raw bytes in the alphabet (how a piece of input text looks in the vocabulary).
    pub(crate) fn encode(&self, bytes: &[u8]) -> String {
        bytes.iter().map(|&b| self.char_of(b)).collect()
    }

    /// Turns a vocabulary token back into raw bytes. Characters outside the alphabet (found in
    /// some converted vocabularies) are kept as their own UTF-8 so nothing is lost.
    pub(crate) fn decode_into(&self, token: &str, out: &mut Vec<u8>) {
        for ch in token.chars() {
            match self.byte_of(ch) {
                Some(b) => out.push(b),
                None => out.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection_with_gpt2_spellings() {
        let alphabet = ByteAlphabet::new();
        let mut seen = std::collections::HashSet::new();
        for byte in 0..=255u8 {
            let ch = alphabet.char_of(byte);
            assert!(seen.insert(ch), "char {ch:?} used twice");
            assert_eq!(alphabet.byte_of(ch), Some(byte));
        }
        // Well-known spellings: space is `Ġ`, newline `Ċ`, tab `ĉ`, NBSP `ł`, 'a' itself.
        assert_eq!(alphabet.char_of(b' '), 'Ġ');
        assert_eq!(alphabet.char_of(b'\n'), 'Ċ');
        assert_eq!(alphabet.char_of(b'\t'), 'ĉ');
        assert_eq!(alphabet.char_of(0xA0), 'ł');
        assert_eq!(alphabet.char_of(b'a'), 'a');
        assert_eq!(alphabet.byte_of('€'), None);
    }

    #[test]
    fn decode_keeps_characters_outside_the_alphabet() {
        let alphabet = ByteAlphabet::new();
        let mut out = Vec::new();
        alphabet.decode_into("ĠhiĊ€", &mut out);
        assert_eq!(out, " hi\n€".as_bytes());
        assert_eq!(alphabet.encode(" hi\n".as_bytes()), "ĠhiĊ");
    }
}
