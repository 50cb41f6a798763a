//! Terminal escape sequences (colours, cursor moves, hyperlinks) removed from output: templates
//! match on the text a reader sees (`tsc --pretty` colours its error codes), and agents get no
//! colour, which is noise in their context.

use std::borrow::Cow;

pub(super) const ESC: u8 = 0x1b;

/// `bytes` without escape sequences: CSI (`ESC [ ... final`), OSC (`ESC ] ... BEL` or
/// `ESC ] ... ESC \`) and two-byte escapes. Borrowed when there are none.
pub(crate) fn strip(bytes: &[u8]) -> Cow<'_, [u8]> {
    if memchr::memchr(ESC, bytes).is_none() {
        return Cow::Borrowed(bytes);
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let Some(off) = memchr::memchr(ESC, &bytes[i..]) else {
            out.extend_from_slice(&bytes[i..]);
            break;
        };
        out.extend_from_slice(&bytes[i..i + off]);
        i += off + 1;
        match bytes.get(i) {
            Some(b'[') => {
                i += 1;
                // Parameters and intermediates, then one final byte in @..~.
                while i < bytes.len() && !(0x40..=0x7e).contains(&bytes[i]) {
                    i += 1;
                }
                i += 1;
            }
            Some(b']') => {
                i += 1;
                while i < bytes.len() {
                    if bytes[i] == 0x07 {
                        i += 1;
                        break;
                    }
                    if bytes[i] == ESC && bytes.get(i + 1) == Some(&b'\\') {
                        i += 2;
                        break;
                    }
                    i += 1;
                }
            }
            Some(b) if (0x40..=0x5f).contains(b) || b"()#78=>".contains(b) => {
                i += 1;
                // Charset selections take one more byte.
                if b"()#".contains(b) {
                    i += 1;
                }
            }
            _ => {}
        }
    }
    Cow::Owned(out)
}

/// [`strip`] for text.
pub(crate) fn strip_str(s: &str) -> Cow<'_, str> {
    match strip(s.as_bytes()) {
        Cow::Borrowed(_) => Cow::Borrowed(s),
        Cow::Owned(b) => Cow::Owned(String::from_utf8_lossy(&b).into_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colours_links_and_plain_text() {
        assert_eq!(
            &*strip(b"\x1b[96msrc/a.ts\x1b[0m:\x1b[93m3\x1b[0m - \x1b[91merror\x1b[0m TS2322"),
            b"src/a.ts:3 - error TS2322"
        );
        assert_eq!(
            &*strip(b"a\x1b]8;;http://x\x07link\x1b]8;;\x1b\\b"),
            b"alinkb"
        );
        assert!(matches!(strip(b"plain"), Cow::Borrowed(_)));
        assert_eq!(&*strip(b"cut\x1b["), b"cut");
        assert_eq!(strip_str("\x1b[1mbold\x1b[22m"), "bold");
    }
}
