/*
 * A mooncaked client in C, written from wire/PROTOCOL.md alone, with msgpack-c (libmsgpack-dev,
 * header msgpack.h, link -lmsgpackc). It checks that the protocol is usable from another
 * language and another msgpack implementation.
 *
 * Usage: client HOST PORT KEY VALUE_SIZE
 *
 * Over TCP it does, in order, and prints one line per step:
 *   hello                                   -> "hello ok protocol 1"
 *   put KEY, a VALUE_SIZE-byte value        -> "put ok"
 *   get KEY, the bytes compared             -> "get ok <n> bytes"
 *   get of a missing key, error -704        -> "miss -704"
 *   exists of a missing key, false          -> "exists false"
 *   an unknown method (msgid 0xFFFFFFFF)    -> "unknown -3002"
 * The value's byte i is (i * 131 + 7) mod 256. Any mismatch prints "FAIL: ..." on stderr and
 * exits with status 1.
 */

#define _POSIX_C_SOURCE 200112L

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <msgpack.h>

#define OBJECT_NOT_FOUND (-704)
#define UNKNOWN_METHOD (-3002)

static int sock = -1;

static void fail(const char *format, ...) {
    va_list args;
    va_start(args, format);
    fputs("FAIL: ", stderr);
    vfprintf(stderr, format, args);
    fputc('\n', stderr);
    va_end(args);
    exit(1);
}

static void send_all(const void *data, size_t size) {
    const char *p = data;
    while (size > 0) {
        ssize_t sent = send(sock, p, size, 0);
        if (sent <= 0) fail("send failed");
        p += sent;
        size -= (size_t)sent;
    }
}

static void recv_all(void *data, size_t size) {
    char *p = data;
    while (size > 0) {
        ssize_t got = recv(sock, p, size, 0);
        if (got == 0) fail("the daemon closed the connection");
        if (got < 0) fail("recv failed");
        p += got;
        size -= (size_t)got;
    }
}

static void connect_tcp(const char *host, const char *port) {
    struct addrinfo hints, *found, *ai;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, port, &hints, &found) != 0) fail("cannot resolve %s:%s", host, port);
    for (ai = found; ai != NULL; ai = ai->ai_next) {
        sock = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
        if (sock < 0) continue;
        if (connect(sock, ai->ai_addr, ai->ai_addrlen) == 0) break;
        close(sock);
        sock = -1;
    }
    freeaddrinfo(found);
    if (sock < 0) fail("cannot connect to %s:%s", host, port);
    int one = 1;
    setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* -- requests: [0, msgid, method, params] ------------------------------------------------- */

static void pack_string(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* Starts a request header in `buffer`; the caller then packs `param_count` params. */
static void begin_request(msgpack_sbuffer *buffer, msgpack_packer *pk, uint32_t msgid,
                          const char *method, uint32_t param_count) {
    msgpack_sbuffer_init(buffer);
    msgpack_packer_init(pk, buffer, msgpack_sbuffer_write);
    msgpack_pack_array(pk, 4);
    msgpack_pack_uint8(pk, 0);
    msgpack_pack_uint32(pk, msgid);
    pack_string(pk, method);
    msgpack_pack_array(pk, param_count);
}

/* Sends the 8-byte prefix, the header and the payload; frees the header buffer. */
static void send_request(msgpack_sbuffer *buffer, const void *payload, uint32_t payload_size) {
    uint32_t prefix[2];
    prefix[0] = htonl((uint32_t)buffer->size);
    prefix[1] = htonl(payload_size);
    send_all(prefix, sizeof prefix);
    send_all(buffer->data, buffer->size);
    if (payload_size > 0) send_all(payload, payload_size);
    msgpack_sbuffer_destroy(buffer);
}

/* -- responses: [1, msgid, error, result] + payload --------------------------------------- */

struct response {
    msgpack_unpacked unpacked;
    char *header;
    msgpack_object error;
    msgpack_object result;
    char *payload;
    uint32_t payload_size;
};

static void read_response(struct response *r, uint32_t msgid) {
    uint32_t prefix[2];
    recv_all(prefix, sizeof prefix);
    uint32_t header_size = ntohl(prefix[0]);
    r->payload_size = ntohl(prefix[1]);
    if (header_size == 0 || header_size > (1u << 20)) fail("header size %u", header_size);
    r->header = malloc(header_size);
    r->payload = malloc(r->payload_size ? r->payload_size : 1);
    if (r->header == NULL || r->payload == NULL) fail("out of memory");
    recv_all(r->header, header_size);
    recv_all(r->payload, r->payload_size);

    size_t offset = 0;
    msgpack_unpacked_init(&r->unpacked);
    if (msgpack_unpack_next(&r->unpacked, r->header, header_size, &offset)
            != MSGPACK_UNPACK_SUCCESS || offset != header_size)
        fail("the header is not exactly one msgpack object");
    msgpack_object header = r->unpacked.data;
    if (header.type != MSGPACK_OBJECT_ARRAY || header.via.array.size != 4)
        fail("a response is an array of 4");
    msgpack_object *parts = header.via.array.ptr;
    if (parts[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER || parts[0].via.u64 != 1)
        fail("not a response (type %d)", (int)parts[0].type);
    if (parts[1].type != MSGPACK_OBJECT_POSITIVE_INTEGER || parts[1].via.u64 != msgid)
        fail("response msgid differs from request msgid %u", msgid);
    r->error = parts[2];
    r->result = parts[3];
}

static void free_response(struct response *r) {
    msgpack_unpacked_destroy(&r->unpacked);
    free(r->header);
    free(r->payload);
}

static void expect_success(const struct response *r, const char *step) {
    if (r->error.type != MSGPACK_OBJECT_NIL) fail("%s: the daemon answered an error", step);
}

static int64_t error_code(const struct response *r, const char *step) {
    if (r->error.type != MSGPACK_OBJECT_ARRAY || r->error.via.array.size != 2)
        fail("%s: expected an error [code, message]", step);
    msgpack_object code = r->error.via.array.ptr[0];
    msgpack_object message = r->error.via.array.ptr[1];
    if (code.type != MSGPACK_OBJECT_NEGATIVE_INTEGER) fail("%s: error code not negative", step);
    if (message.type != MSGPACK_OBJECT_STR) fail("%s: error message not a str", step);
    if (r->result.type != MSGPACK_OBJECT_NIL) fail("%s: an error with a result", step);
    if (r->payload_size != 0) fail("%s: an error with a payload", step);
    return code.via.i64;
}

static int string_is(msgpack_object o, const char *s) {
    size_t n = strlen(s);
    return o.type == MSGPACK_OBJECT_STR && o.via.str.size == n
           && memcmp(o.via.str.ptr, s, n) == 0;
}

static const msgpack_object *map_get(msgpack_object map, const char *key) {
    if (map.type != MSGPACK_OBJECT_MAP) return NULL;
    for (uint32_t i = 0; i < map.via.map.size; i++)
        if (string_is(map.via.map.ptr[i].key, key)) return &map.via.map.ptr[i].val;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s HOST PORT KEY VALUE_SIZE\n", argv[0]);
        return 2;
    }
    const char *key = argv[3];
    long value_size = strtol(argv[4], NULL, 10);
    if (value_size < 1 || value_size > (1L << 30)) fail("bad VALUE_SIZE");
    unsigned char *value = malloc((size_t)value_size);
    if (value == NULL) fail("out of memory");
    for (long i = 0; i < value_size; i++) value[i] = (unsigned char)((i * 131 + 7) & 0xff);

    connect_tcp(argv[1], argv[2]);
    msgpack_sbuffer buffer;
    msgpack_packer pk;
    struct response r;

    /* hello({"protocol": 1, "client_name": "c-client"}) */
    begin_request(&buffer, &pk, 1, "hello", 1);
    msgpack_pack_map(&pk, 2);
    pack_string(&pk, "protocol");
    msgpack_pack_int(&pk, 1);
    pack_string(&pk, "client_name");
    pack_string(&pk, "c-client");
    send_request(&buffer, NULL, 0);
    read_response(&r, 1);
    expect_success(&r, "hello");
    const msgpack_object *protocol = map_get(r.result, "protocol");
    if (protocol == NULL || protocol->type != MSGPACK_OBJECT_POSITIVE_INTEGER
            || protocol->via.u64 != 1)
        fail("hello: result has no protocol 1");
    const msgpack_object *segments = map_get(r.result, "segments");
    if (segments == NULL || segments->type != MSGPACK_OBJECT_ARRAY
            || segments->via.array.size != 0)
        fail("hello: over TCP, segments must be []");
    printf("hello ok protocol %llu\n", (unsigned long long)protocol->via.u64);
    free_response(&r);

    /* put(key, nil) with the value as the payload */
    begin_request(&buffer, &pk, 2, "put", 2);
    pack_string(&pk, key);
    msgpack_pack_nil(&pk);
    send_request(&buffer, value, (uint32_t)value_size);
    read_response(&r, 2);
    expect_success(&r, "put");
    if (r.result.type != MSGPACK_OBJECT_BOOLEAN || !r.result.via.boolean)
        fail("put: expected true (a fresh key)");
    printf("put ok\n");
    free_response(&r);

    /* get(key): result is the size, payload the value */
    begin_request(&buffer, &pk, 3, "get", 1);
    pack_string(&pk, key);
    send_request(&buffer, NULL, 0);
    read_response(&r, 3);
    expect_success(&r, "get");
    if (r.result.type != MSGPACK_OBJECT_POSITIVE_INTEGER
            || r.result.via.u64 != (uint64_t)value_size)
        fail("get: result is not the size %ld", value_size);
    if (r.payload_size != (uint32_t)value_size || memcmp(r.payload, value, value_size) != 0)
        fail("get: the bytes differ from what was put");
    printf("get ok %u bytes\n", r.payload_size);
    free_response(&r);

    /* get of a missing key: OBJECT_NOT_FOUND */
    begin_request(&buffer, &pk, 4, "get", 1);
    pack_string(&pk, "c-client/no-such-key");
    send_request(&buffer, NULL, 0);
    read_response(&r, 4);
    int64_t code = error_code(&r, "miss");
    if (code != OBJECT_NOT_FOUND) fail("miss: code %lld", (long long)code);
    printf("miss %lld\n", (long long)code);
    free_response(&r);

    /* exists of a missing key: false */
    begin_request(&buffer, &pk, 5, "exists", 1);
    pack_string(&pk, "c-client/no-such-key");
    send_request(&buffer, NULL, 0);
    read_response(&r, 5);
    expect_success(&r, "exists");
    if (r.result.type != MSGPACK_OBJECT_BOOLEAN || r.result.via.boolean)
        fail("exists: expected false");
    printf("exists false\n");
    free_response(&r);

    /* an unknown method, with the largest msgid */
    begin_request(&buffer, &pk, 0xFFFFFFFFu, "no_such_method", 0);
    send_request(&buffer, NULL, 0);
    read_response(&r, 0xFFFFFFFFu);
    code = error_code(&r, "unknown");
    if (code != UNKNOWN_METHOD) fail("unknown: code %lld", (long long)code);
    printf("unknown %lld\n", (long long)code);
    free_response(&r);

    close(sock);
    free(value);
    return 0;
}
