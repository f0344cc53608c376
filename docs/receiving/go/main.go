// A minimal Relay webhook receiver in Go (standard library only): verifies
// any of the three schemes, deduplicates on the event id, answers at once
// and processes later.
//
//	RELAY_SECRET=whsec_... PORT=8000 go run main.go
//	RELAY_PUBLIC_KEY=whpk_... for a standard-webhooks-ed25519 endpoint
package main

import (
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"math"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

const tolerance = 5 * time.Minute

var (
	secret    = os.Getenv("RELAY_SECRET")
	publicKey = os.Getenv("RELAY_PUBLIC_KEY")
	seenMu    sync.Mutex
	seen      = map[string]bool{} // in production: a table with a unique key on the event id
	work      = make(chan []byte, 1024)
)

func fresh(ts string) error {
	sent, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || math.Abs(float64(time.Now().Unix()-sent)) > tolerance.Seconds() {
		return errors.New("timestamp missing or outside 5 minutes")
	}
	return nil
}

func mac(key []byte, parts ...string) []byte {
	m := hmac.New(sha256.New, key)
	for _, p := range parts {
		m.Write([]byte(p))
	}
	return m.Sum(nil)
}

// verify returns the event id of a verified request.
func verify(h http.Header, body []byte) (string, error) {
	if sig := h.Get("webhook-signature"); sig != "" { // Standard Webhooks
		id, ts := h.Get("webhook-id"), h.Get("webhook-timestamp")
		if err := fresh(ts); err != nil {
			return "", err
		}
		content := id + "." + ts + "." + string(body)
		for _, entry := range strings.Split(sig, " ") {
			version, value, _ := strings.Cut(entry, ",")
			raw, err := base64.StdEncoding.DecodeString(value)
			if err != nil {
				continue
			}
			switch {
			case version == "v1" && secret != "":
				key, err := base64.RawStdEncoding.DecodeString(strings.TrimRight(strings.TrimPrefix(secret, "whsec_"), "="))
				if err == nil && hmac.Equal(raw, mac(key, content)) {
					return id, nil
				}
			case version == "v1a" && publicKey != "":
				key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(publicKey, "whpk_"))
				if err == nil && len(key) == ed25519.PublicKeySize && ed25519.Verify(key, []byte(content), raw) {
					return id, nil
				}
			}
		}
		return "", errors.New("no signature matches")
	}
	ts := h.Get("relay-webhook-timestamp") // relay-v1
	if err := fresh(ts); err != nil {
		return "", err
	}
	expected := hex.EncodeToString(mac([]byte(secret), "v1:", ts, ":", string(body)))
	for _, entry := range strings.Split(h.Get("relay-webhook-signature"), ",") {
		entry = strings.TrimSpace(entry)
		if strings.HasPrefix(entry, "v1=") && hmac.Equal([]byte(entry[3:]), []byte(expected)) {
			return h.Get("relay-webhook-id"), nil
		}
	}
	return "", errors.New("no signature matches")
}

func receive(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	id, err := verify(r.Header, body)
	if err != nil {
		fmt.Println("rejected:", err)
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	seenMu.Lock()
	duplicate := seen[id]
	seen[id] = true
	seenMu.Unlock()
	if duplicate {
		fmt.Println("duplicate", id)
	} else {
		work <- body
	}
	// Answer fast: Relay counts anything slower than its timeout as a failure.
	w.WriteHeader(http.StatusNoContent)
}

func main() {
	go func() {
		for body := range work {
			var event struct{ ID, Type string }
			_ = json.Unmarshal(body, &event)
			fmt.Println("processed", event.ID, event.Type)
		}
	}()
	port := os.Getenv("PORT")
	if port == "" {
		port = "8000"
	}
	http.HandleFunc("/", receive)
	fmt.Println("listening on", port)
	log.Fatal(http.ListenAndServe("127.0.0.1:"+port, nil))
}
