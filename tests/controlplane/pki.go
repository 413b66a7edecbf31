package main

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// pki holds the file locations and in-memory material of the credentials the
// control plane is started with. They are generated on the first start on a
// data dir and reused by later starts on it, so a restarted control plane
// still accepts the clients (and kubeconfigs) of the earlier one.
type pki struct {
	caPEM []byte

	CAFile           string // CA that signed the serving and admin client certs
	ServingCertFile  string
	ServingKeyFile   string
	AdminCertFile    string // client cert, CN=edgefleet-admin, O=system:masters
	AdminKeyFile     string
	SAKeyFile        string // service-account token signing key (private)
	SAPubFile        string // its public half, used to verify tokens
	TokenFile        string // static token file for --token-auth-file
	AdminToken       string
	AdminUser        string
	adminCertPEM     []byte
	adminKeyPEM      []byte
	servingDNSNames  []string
	servingIPAddress []net.IP
}

const (
	adminUser  = "edgefleet-admin"
	adminGroup = "system:masters"
)

func newKey() (*ecdsa.PrivateKey, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

func randomSerial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 126))
}

func keyPEM(k *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), nil
}

func certPEM(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func writeFile(path string, data []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, mode); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// loadOrGeneratePKI reuses the credentials below dir if a previous start
// left a complete set there, and generates new ones otherwise.
func loadOrGeneratePKI(dir string, serviceIP net.IP) (*pki, error) {
	if p, err := loadPKI(dir); err == nil {
		return p, nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		logf("cannot reuse the credentials in %s (%v); generating new ones", dir, err)
	}
	return generatePKI(dir, serviceIP)
}

// loadPKI reads the credentials a previous generatePKI wrote below dir.
func loadPKI(dir string) (*pki, error) {
	p := pkiFiles(dir)
	for _, f := range []string{p.ServingCertFile, p.ServingKeyFile, p.SAKeyFile, p.SAPubFile} {
		if _, err := os.Stat(f); err != nil {
			return nil, err
		}
	}
	var err error
	if p.caPEM, err = os.ReadFile(p.CAFile); err != nil {
		return nil, err
	}
	if p.adminCertPEM, err = os.ReadFile(p.AdminCertFile); err != nil {
		return nil, err
	}
	if p.adminKeyPEM, err = os.ReadFile(p.AdminKeyFile); err != nil {
		return nil, err
	}
	tokens, err := os.ReadFile(p.TokenFile)
	if err != nil {
		return nil, err
	}
	token, _, ok := strings.Cut(string(tokens), ",")
	if !ok || token == "" {
		return nil, fmt.Errorf("no admin token in %s", p.TokenFile)
	}
	p.AdminToken = token
	return p, nil
}

// pkiFiles names the credential files below dir.
func pkiFiles(dir string) *pki {
	return &pki{
		CAFile:          filepath.Join(dir, "ca.crt"),
		ServingCertFile: filepath.Join(dir, "apiserver.crt"),
		ServingKeyFile:  filepath.Join(dir, "apiserver.key"),
		AdminCertFile:   filepath.Join(dir, "admin.crt"),
		AdminKeyFile:    filepath.Join(dir, "admin.key"),
		SAKeyFile:       filepath.Join(dir, "sa.key"),
		SAPubFile:       filepath.Join(dir, "sa.pub"),
		TokenFile:       filepath.Join(dir, "tokens.csv"),
		AdminUser:       adminUser,
	}
}

// generatePKI creates a CA, a serving certificate for the loopback addresses,
// an admin client certificate and token, and a service-account signing key,
// and writes them below dir.
func generatePKI(dir string, serviceIP net.IP) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	p := pkiFiles(dir)
	p.servingDNSNames = []string{
		"localhost",
		"kubernetes", "kubernetes.default", "kubernetes.default.svc",
		"kubernetes.default.svc.cluster.local",
	}
	p.servingIPAddress = []net.IP{net.ParseIP("127.0.0.1"), net.IPv6loopback, serviceIP}

	now := time.Now()
	notBefore := now.Add(-1 * time.Hour)
	notAfter := now.Add(10 * 365 * 24 * time.Hour)

	// Certificate authority.
	caKey, err := newKey()
	if err != nil {
		return nil, err
	}
	caSerial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          caSerial,
		Subject:               pkix.Name{CommonName: "edgefleet-test-ca"},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, caKey.Public(), caKey)
	if err != nil {
		return nil, fmt.Errorf("creating CA certificate: %w", err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}
	p.caPEM = certPEM(caDER)

	issue := func(tmpl *x509.Certificate) (certPEMBytes, keyPEMBytes []byte, err error) {
		key, err := newKey()
		if err != nil {
			return nil, nil, err
		}
		serial, err := randomSerial()
		if err != nil {
			return nil, nil, err
		}
		tmpl.SerialNumber = serial
		tmpl.NotBefore = notBefore
		tmpl.NotAfter = notAfter
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, key.Public(), crypto.Signer(caKey))
		if err != nil {
			return nil, nil, err
		}
		kp, err := keyPEM(key)
		if err != nil {
			return nil, nil, err
		}
		return certPEM(der), kp, nil
	}

	servingCert, servingKey, err := issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:    p.servingDNSNames,
		IPAddresses: p.servingIPAddress,
	})
	if err != nil {
		return nil, fmt.Errorf("creating serving certificate: %w", err)
	}
	p.adminCertPEM, p.adminKeyPEM, err = issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: adminUser, Organization: []string{adminGroup}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	if err != nil {
		return nil, fmt.Errorf("creating admin client certificate: %w", err)
	}

	// Service-account token signing key.
	saKey, err := newKey()
	if err != nil {
		return nil, err
	}
	saKeyPEM, err := keyPEM(saKey)
	if err != nil {
		return nil, err
	}
	saPubDER, err := x509.MarshalPKIXPublicKey(saKey.Public())
	if err != nil {
		return nil, err
	}
	saPubPEM := pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: saPubDER})

	// Admin bearer token (static token file: token,user,uid,"group1,group2").
	tok := make([]byte, 32)
	if _, err := rand.Read(tok); err != nil {
		return nil, err
	}
	p.AdminToken = hex.EncodeToString(tok)
	tokenCSV := fmt.Sprintf("%s,%s,%s,\"%s\"\n", p.AdminToken, adminUser, adminUser, adminGroup)

	for _, f := range []struct {
		path string
		data []byte
		mode os.FileMode
	}{
		{p.CAFile, p.caPEM, 0o644},
		{p.ServingCertFile, servingCert, 0o644},
		{p.ServingKeyFile, servingKey, 0o600},
		{p.AdminCertFile, p.adminCertPEM, 0o644},
		{p.AdminKeyFile, p.adminKeyPEM, 0o600},
		{p.SAKeyFile, saKeyPEM, 0o600},
		{p.SAPubFile, saPubPEM, 0o644},
		{p.TokenFile, []byte(tokenCSV), 0o600},
	} {
		if err := writeFile(f.path, f.data, f.mode); err != nil {
			return nil, err
		}
	}
	return p, nil
}
