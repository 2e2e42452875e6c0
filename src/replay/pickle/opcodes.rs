//! The pickle opcodes, under their names in Python's `pickle` module, and which of them this
//! reader refuses or does not build.

/// The opcodes, under their names in Python's `pickle` module.
pub(super) mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const POP: u8 = b'0';
    pub const POP_MARK: u8 = b'1';
    pub const DUP: u8 = b'2';
    pub const FLOAT: u8 = b'F';
    pub const INT: u8 = b'I';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const LONG: u8 = b'L';
    pub const BININT2: u8 = b'M';
    pub const NONE: u8 = b'N';
    pub const PERSID: u8 = b'P';
    pub const BINPERSID: u8 = b'Q';
    pub const REDUCE: u8 = b'R';
    pub const STRING: u8 = b'S';
    pub const BINSTRING: u8 = b'T';
    pub const SHORT_BINSTRING: u8 = b'U';
    pub const UNICODE: u8 = b'V';
    pub const BINUNICODE: u8 = b'X';
    pub const APPEND: u8 = b'a';
    pub const BUILD: u8 = b'b';
    pub const GLOBAL: u8 = b'c';
    pub const DICT: u8 = b'd';
    pub const EMPTY_DICT: u8 = b'}';
    pub const APPENDS: u8 = b'e';
    pub const GET: u8 = b'g';
    pub const BINGET: u8 = b'h';
    pub const INST: u8 = b'i';
    pub const LONG_BINGET: u8 = b'j';
    pub const LIST: u8 = b'l';
    pub const EMPTY_LIST: u8 = b']';
    pub const OBJ: u8 = b'o';
    pub const PUT: u8 = b'p';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const SETITEM: u8 = b's';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const SETITEMS: u8 = b'u';
    pub const BINFLOAT: u8 = b'G';
    pub const PROTO: u8 = 0x80;
    pub const NEWOBJ: u8 = 0x81;
    pub const EXT1: u8 = 0x82;
    pub const EXT2: u8 = 0x83;
    pub const EXT4: u8 = 0x84;
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    pub const BINBYTES: u8 = b'B';
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE8: u8 = 0x8d;
    pub const BINBYTES8: u8 = 0x8e;
    pub const EMPTY_SET: u8 = 0x8f;
    pub const ADDITEMS: u8 = 0x90;
    pub const FROZENSET: u8 = 0x91;
    pub const NEWOBJ_EX: u8 = 0x92;
    pub const STACK_GLOBAL: u8 = 0x93;
    pub const MEMOIZE: u8 = 0x94;
    pub const FRAME: u8 = 0x95;
    pub const BYTEARRAY8: u8 = 0x96;
    pub const NEXT_BUFFER: u8 = 0x97;
    pub const READONLY_BUFFER: u8 = 0x98;
}

/// Opcodes that name classes or call code: refused.
pub(super) fn refused_name(code: u8) -> Option<&'static str> {
    Some(match code {
        op::GLOBAL => "GLOBAL",
        op::STACK_GLOBAL => "STACK_GLOBAL",
        op::REDUCE => "REDUCE",
        op::BUILD => "BUILD",
        op::INST => "INST",
        op::OBJ => "OBJ",
        op::NEWOBJ => "NEWOBJ",
        op::NEWOBJ_EX => "NEWOBJ_EX",
        op::PERSID => "PERSID",
        op::BINPERSID => "BINPERSID",
        op::EXT1 => "EXT1",
        op::EXT2 => "EXT2",
        op::EXT4 => "EXT4",
        op::NEXT_BUFFER => "NEXT_BUFFER",
        op::READONLY_BUFFER => "READONLY_BUFFER",
        _ => return None,
    })
}

/// Valid opcodes that snapshots never use: the text forms of protocols 0 and 1, and sets.
pub(super) fn unsupported_name(code: u8) -> Option<&'static str> {
    Some(match code {
        op::FLOAT => "FLOAT",
        op::INT => "INT",
        op::LONG => "LONG",
        op::STRING => "STRING",
        op::BINSTRING => "BINSTRING",
        op::SHORT_BINSTRING => "SHORT_BINSTRING",
        op::UNICODE => "UNICODE",
        op::GET => "GET",
        op::PUT => "PUT",
        op::EMPTY_SET => "EMPTY_SET",
        op::ADDITEMS => "ADDITEMS",
        op::FROZENSET => "FROZENSET",
        _ => return None,
    })
}
